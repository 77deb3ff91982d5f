"""Reading callgrind's output files: what benches/prof/footprint.py and bysource.py share."""
import re


class Names:
    """callgrind's name compression (for `fn=`, `fl=`, `fi=` and the like): a name is
    written as `(id) name` the first time and as `(id)` after; `resolve` gives the name
    either way (`?` for an id never named)."""

    def __init__(self):
        self.names = {}

    def resolve(self, token):
        m = re.match(r"\((\d+)\)(?: (.*))?", token)
        if not m:
            return token
        if m.group(2):
            self.names[m.group(1)] = m.group(2)
        return self.names.get(m.group(1), "?")
