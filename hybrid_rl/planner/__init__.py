"""The memory planner: a config's peak GPU memory per phase, predicted from the model's shape and the settings.

``shape.py`` reads the shape without building the model, ``gpus.py`` knows the cards, ``estimate.py`` is the memory
model (its docstring states every term), ``verdict.py`` names the one setting that makes a config fit, ``report.py``
prints the table. ``hybrid-rl plan RECIPE.yaml`` prints it; ``train`` refuses a config that cannot fit
(``check.py``).
"""
