"""Built-in training tasks (reward functions, datasets, tiny offline models); see asyncgrpo.tasks.demo."""
