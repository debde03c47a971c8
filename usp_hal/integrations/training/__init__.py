"""Training with sequence parallelism: the gradient synchronisation shared by every integration
(:mod:`.grads`), the tiled causal-LM loss (:mod:`.tiled_loss`) and the Hugging Face Trainer
(:mod:`.trainer`).  Importing this package imports none of them (nor transformers)."""
