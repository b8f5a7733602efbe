"""The service kit (config, wire types, app factory, clients), the control plane and the CLI."""
