"""Deployment definitions: the tandem services as a Modal app.

``deploy.config`` says what each role gets (GPUs, containers, timeouts,
images' pinned packages) as a typed, validated ``[modal]`` section;
``deploy.launch`` turns a role into the exact ``tandem serve`` command
line a container runs; ``deploy.modal_app`` wires both into a
``modal.App``. Only ``deploy.modal_app`` imports ``modal``.
"""
