"""The entry points: how tandem is run, above every process it starts.

The ``tandem`` CLI (``cli``), the local stack and its supervisor (``stack``, ``settings``), the
main job ``tandem run`` (``main_job``, ``progress``, ``report``), the run's audit, trace and
export (``audit``, ``trace``, ``export``), the memory planner and model presets (``plan``,
``presets``, ``layout``), datasets imported as prompt sets (``datasets``) and the Modal app
(``config``: the ``[modal]`` section; ``launch``: each role's ``tandem serve`` line;
``modal_app``: the ``modal.App``; ``autoscale``). Only ``deploy.modal_app`` imports ``modal``.
"""
