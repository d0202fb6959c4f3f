"""Training loops, one readable file each. A recipe is a module with ``train(cfg, accelerator)``."""
