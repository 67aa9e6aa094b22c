"""What a run shows in Prefect and sends to automations.

- `summary`: the run's name and tags, its progress line, its markdown summary and metrics table.
- `curve`: the training curve, drawn with matplotlib.
- `events`: the Prefect events a run sends (endpoints' lives, given-up attempts, its end, its spend), and a study's
  end.
- `study`: a study's comparison: a row per child, the best child, their curves overlaid, its summary and table.
- `study_names`: a study's children's names, and their values as the table, the log and refusals show them.
- `serving`: the account's serving endpoints with their age, billed cost and expiry (the reconcile and volumes
  reports).
"""
