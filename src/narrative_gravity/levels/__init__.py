"""The article's other levels around decoding: passages (:mod:`.context`), conversation memory (:mod:`.memory`),
outlines (:mod:`.plan`), and one request through every level (:mod:`.pipeline`)."""
