"""The CPU backend (backend.py): Sluice's C kernels (engine/csrc/, built by engine/cpu/build.py) behind
engine/backend.py's interface."""
