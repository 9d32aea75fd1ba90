"""The driver's phases of a step, each one call from ``Trainer.train_on``: ``reward`` (scoring, the overlong
penalty, DAPO's group filtering), ``group_rows`` (a sequence-parallel group's rows), ``old_log_prob`` (the step's
π_old plan), ``advantage`` (the glue to the pure estimators of ``hybrid_rl.algorithms``), ``balance`` (groups
traded between the data-parallel ranks before the updates, ``trainer.balance_batch``).

Each phase takes a batch and returns it with its results added, and its metrics as (sum, count) pairs or values.
"""
