"""A plan as data and what is made of it: ``plan.py`` (the record, its JSON, the predicted
peak and step time), ``advice.py`` (where its redundant bytes sit), ``report.py`` (readable
tables) and ``export.py`` (a baseline handed to the framework it is named after)."""
