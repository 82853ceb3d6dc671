# The verify schedules eval.py offers: here, not in eval/run.py, so that eval.py --help needs no torch import.
SCHEDULES = ("fixed", "confidence")
# The longest context suffix prompt lookup matches (eval/lookup.py); eval.py --lookup-first N asks for N..this.
LOOKUP_MAX_N = 3
