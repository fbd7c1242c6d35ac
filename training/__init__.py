"""Training, evaluation and export of the embedded default model (not installed with the package)."""
