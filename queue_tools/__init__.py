"""The operator CLI: `queue_tools ls | cleanup`."""
