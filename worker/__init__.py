"""The worker: claims jobs, generates and scores completions."""
