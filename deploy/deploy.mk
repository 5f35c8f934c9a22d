# Deployment targets; included from the top-level Makefile.
#   make deploy-check   offline checks of deploy/ (renders, schemas, wiring, configs, Dockerfiles)
#   make image          build the server image offline into target/image/hookwire.oci.tar

.PHONY: deploy-check image

deploy-check: deps
	deploy/check.sh

## The image's own dependencies (buildah, skopeo, ...) come first.
image:
	deploy/deps.sh image
	deploy/build-image.sh
