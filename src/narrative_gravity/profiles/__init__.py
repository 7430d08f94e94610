"""Profiles: the one validator (:mod:`.schema`), profile -> kernel program (:mod:`.build`), and the config centre
(:mod:`.store`, :mod:`.rollout`, :mod:`.promote`, :mod:`.report`)."""
