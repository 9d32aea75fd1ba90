"""The ways a step's batch is made: ``sources`` (one ``RolloutSource`` per mode: sync, overlap, split), ``overlap``
(the one-step double buffer with its staleness bound), ``partial`` (partial rollouts: interrupt the long tail, carry it
over), ``split`` (generate-only and train-only ranks, their groups and hand-over) and ``placement`` (which part a rank
plays, decided before its worker exists)."""
