"""Run localstripe on loopback only, with no /tmp/localstripe.pickle: started by
`tests/external/localstripe_server.py` with the interpreter of `.venv-localstripe`
(localstripe's own venv, made by `make`), never imported by the suite.

The stock `localstripe` command binds '::' (every interface) and pickles its whole store to
/tmp/localstripe.pickle after every write, a file every instance on the host shares.
"""

import argparse

from aiohttp import web
from localstripe import resources
from localstripe.server import app

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
args = parser.parse_args()
resources.Store.dump_to_disk = lambda self: None  # no pickle (also O(store) per write)
web.run_app(app, host="127.0.0.1", port=args.port, print=None)
