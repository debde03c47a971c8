"""Kernel adapters, one module per backend.  Importing a module here never imports its
kernel package: that happens on first use, inside the adapter."""
