"""The app: everything behind the `fsdplab` command.

- cli: the command line (`fsdplab lab`, `run`, `estimate`, `site`, `doctor`); `python -m fsdplab` is it too
- run: `fsdplab run`, each lesson through papermill in a kernel of its own, a summary row per lesson
- forkserver, fork_client: the run's rank processes, forked from one process that imported torch once
- estimates_ahead: a run's later full-scale estimates, made in a background worker
- lab: the learner's copy of the lessons in JupyterLab; site: the lessons as static pages
- doctor: what a GPU machine has, checked before a run
"""
