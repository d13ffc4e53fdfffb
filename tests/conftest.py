"""Suite-wide settings: one intra-op thread per process, as every rank of the
distributed tests uses, so tests do not fight over the CI machine's two cores."""

import torch

torch.set_num_threads(1)
