"""Cost models: bytes per device (memory.py) and collectives with their time (comm.py)."""
