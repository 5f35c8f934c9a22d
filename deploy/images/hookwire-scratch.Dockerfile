# hookwire server image from nothing but a static binary and a few files:
# what deploy/build-image.sh builds with buildah where no base image can be
# pulled. Its context is a root filesystem the script stages (binary, CA
# bundle, passwd/group with the nonroot user, nsswitch.conf) and an empty
# data directory; the result matches deploy/Dockerfile's.
FROM scratch
COPY rootfs/ /
# The default store's directory, owned by the server's user (see
# deploy/Dockerfile).
COPY --chown=65532:65532 data/ /var/lib/hookwire/
VOLUME ["/var/lib/hookwire"]
USER 65532:65532
EXPOSE 50051 9464
ENV HOOKWIRE_LISTEN=0.0.0.0:50051 \
    HOOKWIRE_ADMIN_LISTEN=0.0.0.0:9464 \
    HOOKWIRE_DATA_DIR=/var/lib/hookwire
ENTRYPOINT ["/usr/local/bin/hookwire", "serve"]
