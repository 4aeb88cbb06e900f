"""GPU worker: pulls requests from tenant streams, batches them through the model, publishes tokens."""
