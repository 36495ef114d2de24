#!/usr/bin/env bash
# Builds (and with --push, pushes) the images the Kubernetes manifests run, from the repository root:
#
#   deploy/images.sh --print                                   # the commands only, nothing is run
#   deploy/images.sh                                           # build all four for the local docker
#   deploy/images.sh --registry registry.example.com/llm --push cpu gateway
#   deploy/images.sh --registry registry.example.com/llm --platform linux/amd64 --push   # docker buildx
#
# image     Dockerfile (stage)                  tag                       run by
# cpu       deploy/Dockerfile (cpu)             tpserve:VERSION           overlays cpu, cpu-*
# gpu       deploy/Dockerfile (gpu)             tpserve:VERSION-cuda      overlays gpu, gpu-*
# gateway   k8s/components/gateway/Dockerfile   tpserve-gateway:VERSION   components/gateway
# loadtest  k8s/loadtest/Dockerfile             tpserve-loadtest:VERSION  k8s/loadtest
#
# VERSION is pyproject.toml's (--tag overrides it). With --registry R the images are R/NAME:TAG;
# point the manifests at the same names once, with kustomize's `images:` (docs/kubernetes.md).
# Every docker command is printed before it runs; --print prints them and runs none (exit 0),
# one command per line, shell-quoted.
set -euo pipefail

usage() {
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
  echo "Options: --registry R, --tag T, --platform P (docker buildx, one or more: linux/amd64,linux/arm64),"
  echo "         --push, --print, -h; then any of: cpu gpu gateway loadtest (default: all)"
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
registry=${REGISTRY:-}
tag=""
platform=""
push=0
print_only=0
selected=()
value() {  # the value after option $1, or exit 2
  [ $# -ge 2 ] && [ -n "$2" ] && [[ "$2" != --* ]] || { echo "images.sh: $1 needs a value" >&2; exit 2; }
  echo "$2"
}
while [ $# -gt 0 ]; do
  case "$1" in
    --registry) registry=$(value "$@"); shift 2 ;;
    --registry=*) registry=${1#*=}; shift ;;
    --tag) tag=$(value "$@"); shift 2 ;;
    --tag=*) tag=${1#*=}; shift ;;
    --platform) platform=$(value "$@"); shift 2 ;;
    --platform=*) platform=${1#*=}; shift ;;
    --push) push=1; shift ;;
    --print|--dry-run) print_only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    cpu|gpu|gateway|loadtest) selected+=("$1"); shift ;;
    *) echo "images.sh: unknown argument '$1' (images: cpu gpu gateway loadtest; -h for help)" >&2; exit 2 ;;
  esac
done
[ ${#selected[@]} -gt 0 ] || selected=(cpu gpu gateway loadtest)
if [ -z "$tag" ]; then
  tag=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -n 1)
  [ -n "$tag" ] || { echo "images.sh: no version in $root/pyproject.toml (give --tag)" >&2; exit 2; }
fi
registry=${registry%/}
if [ "$push" = 1 ] && [ -z "$registry" ]; then
  # An unprefixed name pushes to Docker Hub's library/ namespace: almost never meant.
  echo "images.sh: --push needs --registry R (or \$REGISTRY): the images would go to Docker Hub as library/NAME" >&2; exit 2
fi
if [ -n "$platform" ] && [ "$push" = 0 ] && [[ "$platform" == *,* ]]; then
  # buildx can load only a single-platform image into the local docker.
  echo "images.sh: several platforms ($platform) need --push (buildx cannot --load them)" >&2; exit 2
fi

# name -> "image-name tag-suffix dockerfile target" (target "-": the Dockerfile's only stage).
spec() {
  case "$1" in
    cpu) echo "tpserve $tag deploy/Dockerfile cpu" ;;
    gpu) echo "tpserve $tag-cuda deploy/Dockerfile gpu" ;;
    gateway) echo "tpserve-gateway $tag k8s/components/gateway/Dockerfile -" ;;
    loadtest) echo "tpserve-loadtest $tag k8s/loadtest/Dockerfile -" ;;
  esac
}

run() {
  printf '%q ' "$@" | sed 's/ $//'
  echo
  [ "$print_only" = 1 ] || (cd "$root" && "$@")
}

for name in "${selected[@]}"; do
  read -r image image_tag dockerfile target <<<"$(spec "$name")"
  ref="${registry:+$registry/}$image:$image_tag"
  target_args=()
  [ "$target" = "-" ] || target_args=(--target "$target")
  if [ -n "$platform" ]; then
    output=--load
    [ "$push" = 1 ] && output=--push
    run docker buildx build --platform "$platform" -f "$dockerfile" "${target_args[@]}" -t "$ref" "$output" .
  else
    run docker build -f "$dockerfile" "${target_args[@]}" -t "$ref" .
    [ "$push" = 0 ] || run docker push "$ref"
  fi
done
