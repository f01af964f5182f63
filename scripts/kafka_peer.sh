#!/usr/bin/env bash
# Fetches the jars of an Apache Kafka broker (KRaft, 4.x) from Maven Central into a
# cache outside the repository and prints the directory holding them, so that
#
#     java -cp "$(scripts/kafka_peer.sh)/*" kafka.Kafka server.properties
#
# runs a broker. Used by bench/kafka_peer.py (Kafka as a benchmark peer).
#
# Idempotent: a finished cache is marked by a stamp file naming what was fetched; when the
# stamp matches, the script prints the directory and exits without calling Maven. A fetch
# goes to a staging directory that is moved into place only when complete, under a lock,
# so an interrupted or concurrent run never leaves a half-filled classpath behind.
#
# What is fetched: org.apache.kafka:kafka_2.13 (the broker, whose runtime dependencies
# bring kafka-server, kafka-storage, kafka-raft, kafka-metadata, the coordinators, the
# clients, Scala and Jackson) plus a logging backend: log4j-core and its SLF4J 2 binding,
# as in Kafka's own distribution, with slf4j-api 2.x named directly (Kafka's published POMs
# ask for slf4j-api 1.7.36, which would not see an SLF4J 2 binding and log nothing).
#
# Environment:
#   KAFKA_VERSION    broker version (default 4.4.0)
#   LOG4J_VERSION    log4j-core / log4j-slf4j2-impl version (default 2.26.1)
#   SLF4J_VERSION    slf4j-api version (default 2.0.17)
#   ATOMLOG_CACHE    cache root (default $HOME/.cache/atomlog); the jars go to
#                    $ATOMLOG_CACHE/kafka-$KAFKA_VERSION
#   MVN              the Maven command (default mvn)
#   MVN_TIMEOUT_S    limit on the Maven run, in seconds (default 900)
#
# Exit status: 0 with the directory on stdout; non-zero with the reason on stderr (no
# Maven, fetch failed or timed out). Maven's output goes to stderr only on failure.
set -euo pipefail

KAFKA_VERSION="${KAFKA_VERSION:-4.4.0}"
LOG4J_VERSION="${LOG4J_VERSION:-2.26.1}"
SLF4J_VERSION="${SLF4J_VERSION:-2.0.17}"
DEPENDENCY_PLUGIN="org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
CACHE_ROOT="${ATOMLOG_CACHE:-$HOME/.cache/atomlog}"
TARGET="$CACHE_ROOT/kafka-$KAFKA_VERSION"
STAMP_NAME=".atomlog-kafka-peer"
WANT="kafka_2.13:$KAFKA_VERSION log4j:$LOG4J_VERSION slf4j:$SLF4J_VERSION"
MVN="${MVN:-mvn}"
MVN_TIMEOUT_S="${MVN_TIMEOUT_S:-900}"

say() { printf '[kafka_peer] %s\n' "$*" >&2; }

cached() { [ -f "$TARGET/$STAMP_NAME" ] && [ "$(cat "$TARGET/$STAMP_NAME")" = "$WANT" ]; }

if cached; then
  echo "$TARGET"
  exit 0
fi

if ! command -v "$MVN" >/dev/null 2>&1 && [ "$MVN" = mvn ]; then
  # As scripts/bootstrap.sh does for Java and ZooKeeper: the Debian package, when missing.
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  say "installing Maven (Debian package maven) to fetch the Kafka jars"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
      --no-install-recommends maven >/dev/null; } || true
fi
command -v "$MVN" >/dev/null 2>&1 || { say "Maven ($MVN) not found; install it (apt-get install maven)"; exit 2; }
command -v java >/dev/null 2>&1 || { say "java not found; install a JRE 17+ (apt-get install default-jre-headless)"; exit 2; }

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.kafka-$KAFKA_VERSION.lock"
if ! flock -w "$MVN_TIMEOUT_S" 9; then
  say "timed out after ${MVN_TIMEOUT_S}s waiting for another fetch into $TARGET"
  exit 3
fi
if cached; then  # another run finished the fetch while this one waited for the lock
  echo "$TARGET"
  exit 0
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/atomlog-kafka-fetch.XXXXXX")"
STAGING="$CACHE_ROOT/.kafka-$KAFKA_VERSION.staging.$$"
cleanup() { rm -rf "$WORK" "$STAGING"; }
trap cleanup EXIT

cat > "$WORK/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0"
         xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"
         xsi:schemaLocation="http://maven.apache.org/POM/4.0.0 http://maven.apache.org/xsd/maven-4.0.0.xsd">
  <modelVersion>4.0.0</modelVersion>
  <groupId>atomlog.bench</groupId>
  <artifactId>kafka-peer-classpath</artifactId>
  <version>0</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>$KAFKA_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j2-impl</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-api</artifactId>
      <version>$SLF4J_VERSION</version>
    </dependency>
  </dependencies>
</project>
EOF

say "fetching Kafka $KAFKA_VERSION broker jars from Maven Central into $TARGET"
mkdir -p "$STAGING"
if ! timeout "$MVN_TIMEOUT_S" "$MVN" -B -q -Dstyle.color=never -f "$WORK/pom.xml" \
      "$DEPENDENCY_PLUGIN:copy-dependencies" \
      -DincludeScope=runtime -DoutputDirectory="$STAGING" >"$WORK/mvn.log" 2>&1; then
  tail -n 40 "$WORK/mvn.log" >&2
  say "Maven could not fetch the Kafka $KAFKA_VERSION jars (log above)"
  exit 4
fi
ls "$STAGING"/kafka_2.13-"$KAFKA_VERSION".jar >/dev/null 2>&1 || {
  say "the fetch finished without kafka_2.13-$KAFKA_VERSION.jar"; exit 4; }

echo "$WANT" > "$STAGING/$STAMP_NAME"
rm -rf "$TARGET"
mv "$STAGING" "$TARGET"
say "$(find "$TARGET" -name '*.jar' | wc -l) jars, $(du -sh "$TARGET" | cut -f1)"
echo "$TARGET"
