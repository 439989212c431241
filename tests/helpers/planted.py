"""An object whose unpickling runs code, as a malicious checkpoint's would: it writes a marker file."""


class Planted:
    """Unpickling it runs code: it writes ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)
