"""hetplan: plan and run large-model training on clusters of mixed GPUs."""

__version__ = "0.1.0"
