"""A trained model and its sampler (role), training batches, the actor-critic option."""
