from nemo_rl.algorithms.loss.interfaces import LossFunction, LossInputType, LossType  # noqa: F401
from nemo_rl.algorithms.loss.loss_functions import (  # noqa: F401
    CLIPPED_PG_DATA_KEYS,
    ClippedPGLossConfig,
)
