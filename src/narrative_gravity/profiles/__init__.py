"""Profiles: the one validator (:mod:`.schema`), profile -> kernel program (:mod:`.build`), and the config centre:
named, versioned profiles (:mod:`.store`, with its arm log :mod:`.armlog`) and how their traffic is shadowed and
split (:mod:`.rollout`). What reads the evaluation sits above it, in :mod:`narrative_gravity.eval`: the promotion
gate (:mod:`~narrative_gravity.eval.promote`) and the arms compared (:mod:`~narrative_gravity.eval.rollout_report`)."""
