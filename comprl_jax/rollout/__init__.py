"""Episodes over env pools: the lock-step and continuous engines, task sampling."""
