# The verify schedules eval.py offers: here, not in eval/run.py, so that eval.py --help needs no torch import.
SCHEDULES = ("fixed", "confidence")
