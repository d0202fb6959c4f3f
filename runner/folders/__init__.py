"""The run folder as data: what it holds, who wrote it, and what a config from someone else's folder may reach.

- :mod:`~runner.folders.layout`: every name in a run folder, defined once; no links in one.
- :mod:`~runner.folders.provenance`: whose run a folder is, and the code resuming it may call.
- :mod:`~runner.folders.foreign_config`: what a config you did not write may read from your environment, and where
  it would send the run.
- :mod:`~runner.folders.kinds`, :mod:`~runner.folders.run_log`: which folders are runs and sweeps; run.log's lines.
- :mod:`~runner.folders.launch_record`, :mod:`~runner.folders.code_versions`: what made each launch of a run (its
  ``provenance/attempt_N.json``), and the git state of the code it ran.
- :mod:`~runner.folders.state_compare`: two checkpoints, or two runs' logged values, compared bit for bit.

It may import the config (:mod:`runner.config`), :mod:`runner.files` and the engine's checkpoint room; nothing above
it, and not torch at import.
"""
