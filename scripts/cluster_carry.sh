#!/usr/bin/env bash
# Make the two carry folders scripts/gpu.sh cluster needs on the GPU machine (Python 3.12, no
# registry there): LiteLLM's proxy and the packages it needs that the GPU image lacks.
#
#   bash scripts/cluster_carry.sh          # -> .carry/cluster-a (~35 MB), .carry/cluster-b (~16 MB)
#
# The list: the dependency closure of litellm 1.110.2 (+ the proxy's packages from pyproject.toml,
# + openai for the load client) minus what the GPU image holds (.library/device/KINDS.md), minus
# boto3/botocore/s3transfer/jmespath (the proxy never imported them in a CPU run that recorded
# the front's and a worker's sys.modules), plus small pure-Python packages the image has at
# unknown versions whose minimums fastapi/pydantic/litellm depend on.
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP/w" \
    litellm==1.110.2 \
    annotated-types==0.8.0 apscheduler==3.11.3 backoff==2.2.1 cryptography==50.0.2 expression==5.8.0 \
    fastapi-sso==0.23.0 fastapi==0.165.0 fastuuid==0.14.0 httpcore2==2.16.2 httpx2==2.16.2 \
    importlib-metadata==8.9.0 jiter==0.19.0 jsonschema-specifications==2025.9.1 jsonschema==4.26.0 \
    mcp-types==2.3.0 mcp==2.3.0 oauthlib==4.0.1 openai==3.57.0 opentelemetry-api==1.45.2 orjson==3.13.0 \
    pydantic-core==2.50.5 pydantic-settings==2.16.3 pydantic==2.14.4 pyjwt==2.15.1 python-dotenv==1.2.4 \
    python-multipart==0.0.34 redis==8.1.0 referencing==0.37.0 rpds-py==2026.9.1 semver==3.1.2 \
    sniffio==1.3.1 soundfile==0.14.0 sse-starlette==3.7.0 starlette==1.10.0 truststore==0.10.5 \
    typing-inspection==0.4.5 tzlocal==5.4.5 uvicorn==0.54.0 websockets==17.4 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 email-validator dnspython \
    typing-extensions==4.16.0 anyio==4.16.0 annotated-doc==0.0.7 h11==0.16.0 httpcore==1.0.9 \
    httpx==0.28.1 click==8.5.1 idna==3.20 certifi==2026.10.19.post1 attrs==26.1.0 packaging==26.4 \
    jinja2==3.1.6 zipp==4.1.2
rm -rf .carry/cluster-a .carry/cluster-b
mkdir -p .carry/cluster-a .carry/cluster-b
mv "$TMP"/w/litellm-*.whl "$TMP/litellm.whl"
mv "$TMP"/w/*.whl .carry/cluster-b/
# the wheel less its admin UI (7 MB compressed; the proxy logs that the UI is missing and serves the API)
python3 - "$TMP/litellm.whl" .carry/cluster-a/litellm-1.110.2-slim.zip <<'EOF'
import sys, zipfile
src = zipfile.ZipFile(sys.argv[1])
with zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
    for info in src.infolist():
        if not info.filename.startswith("litellm/proxy/_experimental/out/"):
            dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
EOF
du -sh .carry/cluster-a .carry/cluster-b
