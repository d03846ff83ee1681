"""RL core: subgroup PPO-clip actor loss, CISPO extractor loss, train states and jitted update steps.

See :mod:`comprl_jax.rl.losses` for the batch layout.
"""

from comprl_jax.rl.advantages import (
    CRITIC_SCORES,
    count_aware_weight,
    extractor_advantages,
    self_distillation_select,
    subgroup_advantages,
    whole_group_advantages,
)
from comprl_jax.rl.losses import (
    ActorLossConfig,
    ExtractorLossConfig,
    actor_loss,
    aggregation_weights,
    extractor_loss,
    finalize_metrics,
    token_logprobs,
)
from comprl_jax.rl.train_state import (
    OptimConfig,
    TrainState,
    create_train_state,
    make_optimizer,
    train_state_shardings,
)
from comprl_jax.rl.update import (
    accumulate_gradients,
    compute_logprobs,
    make_logprob_fn,
    make_update_fn,
)

__all__ = [
    "CRITIC_SCORES",
    "ActorLossConfig",
    "ExtractorLossConfig",
    "OptimConfig",
    "TrainState",
    "accumulate_gradients",
    "actor_loss",
    "aggregation_weights",
    "compute_logprobs",
    "count_aware_weight",
    "create_train_state",
    "extractor_advantages",
    "extractor_loss",
    "finalize_metrics",
    "make_logprob_fn",
    "make_optimizer",
    "make_update_fn",
    "self_distillation_select",
    "subgroup_advantages",
    "token_logprobs",
    "train_state_shardings",
    "whole_group_advantages",
]
