"""The parameter server: trains the policy on results from the queue."""
