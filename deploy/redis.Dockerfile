# Redis from Debian's redis-server package (7.0 in bookworm): the compose file's Redis
# where the public redis:7 image cannot be pulled (deploy/image.sh builds it). The compose
# file gives it its config (password, AOF) and the /data volume.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
