"""One file per model architecture; `registry` maps HF architecture names to them."""
