"""The CPU backend (backend.py): Sluice's C kernels (engine/csrc/, built by engine/cpu_kernels.py) behind
engine/backend.py's interface."""
