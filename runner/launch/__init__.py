"""The processes of a run: start them (torch's elastic launcher, or join torchrun / srun), and what each one runs.

elastic.py      start the workers here, or train in this process; failures.py: the failed rank's sentence;
                preload.py: their forkserver, started before the checks import torch
worker.py       what every training process runs: logging, the Accelerator, the recipe
lock.py         the run folder's lock; preflight.py: checks before launch; slurm.py: srun's tasks
commands.py     runner launch / config / env for a plain engine script, as Accelerate's: script.py (launch),
                configure.py (config), env_report.py (env), settings.py (the settings and their file), flags.py

It may import what is below it (the config, run folders, training, data, models, metrics and the engine); never
the command line or sweeps.
"""
