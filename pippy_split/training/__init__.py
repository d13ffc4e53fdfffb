"""The parts of ``pippy-split train`` (:mod:`pippy_split.train` is the entry point):
``setup`` (data, model, the split Pipe; ``corpus`` the built-in sums), ``loop`` (one
rank's training, periodic checkpoints, resuming after a restart) and ``finish`` (the
merged ``model.pt``, samples)."""
