"""The main CLI's own commands, one module per job: ``options`` (the shared option
declarations), ``common`` (consoles, cost parameters and profile, precision and batch),
``planning`` (plan, predict, explain), ``calibrate``, ``provision`` and ``export``. Each
module's ``register(app)`` adds its commands; ``hetplan.cli`` builds the application."""
