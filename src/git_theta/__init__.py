"""git-theta: version ML model checkpoints in Git, one tensor at a time.

Kept import-free on purpose: the filter process starts once per git command and
should not pay for anything it does not use.
"""

__version__ = "0.1.0"
