"""The fault-injection suite: `make faults` (tests/faults/run.py); a few quick cases run
in the default suite from tests/test_faults.py."""
