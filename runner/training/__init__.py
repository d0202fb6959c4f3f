"""What a recipe's training process uses besides the engine: building, the loop's bookkeeping, trackers, stops.

- :mod:`~runner.training.components`: the config's ``_target_`` nodes built, and how a batch meets the model.
- :mod:`~runner.training.loop`: the step loop's cadences and counts, progress, throughput, the metrics file.
- :mod:`~runner.training.tracker_setup`: the run's trackers as its ``tracker`` node declares them.
- :mod:`~runner.training.preemption`: a scheduler's stop signal turned into one agreed step and a checkpoint.
- :mod:`~runner.training.startup`: where a run's start-up time goes (the command line stamps it too).

It may import the config, the run folder's names, the data and models packages and the engine; nothing above it
(the command line, sweeps, the launch). Importing it imports nothing: the command line reads
:mod:`~runner.training.startup` without torch.
"""
