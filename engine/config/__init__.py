"""Settings: EngineSettings / ServerSettings (settings.py) are the only place settings are defined; where
values come from besides flags (sources.py: kiln.toml, KILN_* variables), what kiln writes into the process
environment (process_env.py) and the settings applied before torch loads (process_setup.py: prepare_process,
called by each entry point), how values may be written (values.py), how errors are told (build.py), and a
model's generation_config.json as request defaults."""
