# Sourced by the GPU scripts: the device image has transformers 5.17.0 and no network, so the transformers
# 5.24.0 wheel (pure Python) travels in .whl and is installed to /tmp/site, ahead of the image's copy.
#   here, once, in the repo root:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0
#   device call: carry [".whl"]
if compgen -G ".whl/transformers-5.24.0-*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/transformers-5.24.0-*.whl || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
