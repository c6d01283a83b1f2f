"""asyncgrpo: asynchronous GRPO. A parameter server trains while workers generate,
talking through a file-system job queue (asyncgrpo.jobqueue)."""

__version__ = "0.1.0"
