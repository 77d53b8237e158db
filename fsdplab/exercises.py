"""Exercises that check themselves, and "predict, then run" prompts: what a notebook imports.

`check("02-bytes", answer)` runs the checker lesson 02 registered (`fsdplab.lessons.checkers`, where the
lessons keep their registry) and prints a verdict with a hint; `reveal` prints a prediction beside the
measured value.
"""

from .lessons.checkers import Verdict, check, close, exercise, keys, reveal

__all__ = ["Verdict", "check", "close", "exercise", "keys", "reveal"]
