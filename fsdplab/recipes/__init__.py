"""End-to-end recipes: the lessons' case studies as functions a notebook, a test and `torchrun` share."""
