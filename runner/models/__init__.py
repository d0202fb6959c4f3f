"""Small reference models: plain ``nn.Module``s that know nothing about how they are parallelised.

They may import the config's errors, the run folder's provenance (a run's weights are data), the engine's
checkpoint room and its pipeline plans (how a model is cut into stages, beside its tp_plan); nothing above them.
"""

from runner.models.adapters import with_peft
from runner.models.cnn import MnistCNN
from runner.models.gpt import GPT
from runner.models.pipeline_plans import gpt2_plan  # registers the plans of the models it knows
from runner.models.run_weights import from_run

__all__ = ["GPT", "MnistCNN", "from_run", "gpt2_plan", "with_peft"]
