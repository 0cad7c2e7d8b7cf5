#!/usr/bin/env bash
# The services the test suite uses, on a Debian machine, as root:
#
#   scripts/services.sh up       install what is missing, configure it, start it (idempotent)
#   scripts/services.sh status   what listens and what is installed; exit 1 if a service is down
#   scripts/services.sh down     stop the services `up` starts
#
# Shared servers, on loopback only: Redis 7 (6379, no persistence), PostgreSQL 15 (5432, trust
# auth, databases test and root), MariaDB 10.11 (3306, root without a password over TCP,
# database test), RabbitMQ (5672, guest/guest), NATS with JetStream (4222). Installed only, for
# the tests that start private ones: nats-server, prometheus, redis-cli, the Pub/Sub emulator, a
# JRE and Maven; and the jars of the Java servers (Kafka, ElasticMQ), resolved into a cache
# outside the repository (tests/maven_jars.py says where). On a machine where all of it already runs, `up` changes
# nothing and takes a second or two.
# A failure names the service, what went wrong and the log to read.
set -euo pipefail

# How long each server may take to accept connections after its start. RabbitMQ's first boot
# creates its database and enables its feature flags: about 10 s on two cores, more under load.
START_DEADLINE=${SERVICES_START_DEADLINE:-60}

REDIS_LOG=/var/log/redis/services.log
NATS_LOG=/var/log/nats-server/services.log
NATS_PIDFILE=/run/nats-server-services.pid
MARIADB_LOG=/var/log/mysql/services.log
RABBITMQ_LOG_DIR=/var/log/rabbitmq

log() { printf '== services: %s\n' "$*"; }
fail() {  # fail SERVICE WHY [LOG]
    printf 'services: %s: %s\n' "$1" "$2" >&2
    if [ -n "${3:-}" ]; then
        printf 'services: %s log: %s (last lines follow)\n' "$1" "$3" >&2
        tail -n 25 "$3" 2>/dev/null | sed 's/^/    /' >&2 || true
    fi
    exit 1
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_until() {  # wait_until SERVICE LOG COMMAND...: poll COMMAND until it succeeds or the deadline
    local service=$1 logfile=$2
    shift 2
    local deadline=$((SECONDS + START_DEADLINE))
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            fail "$service" "not answering ${START_DEADLINE} s after its start" "$logfile"
        fi
        sleep 0.2
    done
}

pg_version() { ls /usr/lib/postgresql 2>/dev/null | sort -n | tail -n 1; }

# --- installing -------------------------------------------------------------------------------

missing_packages() {  # the Debian packages whose programs are not here
    command -v redis-server >/dev/null || echo redis-server
    command -v redis-cli >/dev/null || echo redis-tools
    [ -n "$(pg_version)" ] || echo postgresql
    command -v mariadbd >/dev/null || echo mariadb-server
    command -v rabbitmq-server >/dev/null || echo rabbitmq-server
    command -v nats-server >/dev/null || echo nats-server
    command -v prometheus >/dev/null || echo prometheus
    command -v java >/dev/null || echo default-jre-headless
    command -v mvn >/dev/null || echo maven
    dpkg -s google-cloud-cli-pubsub-emulator >/dev/null 2>&1 || echo google-cloud-cli-pubsub-emulator
}

install_missing() {
    local packages
    packages=$(missing_packages | tr '\n' ' ')
    [ -n "${packages// /}" ] || return 0
    log "installing from Debian's packages: $packages"
    # Packages must not start their services on install: this script starts them, configured.
    local made_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        made_policy=1
    fi
    local apt_log
    apt_log=$(mktemp /tmp/services-apt.XXXXXX.log)
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends $packages; } >"$apt_log" 2>&1; then
        [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
        fail "apt-get" "could not install $packages" "$apt_log"
    fi
    [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
    rm -f "$apt_log"
}

# --- the servers ------------------------------------------------------------------------------

redis_up() {
    if ! port_open 6379; then
        log "starting Redis on 127.0.0.1:6379"
        mkdir -p /var/lib/redis /var/log/redis
        redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
            --appendonly no --dir /var/lib/redis --logfile "$REDIS_LOG" \
            || fail redis "redis-server did not start" "$REDIS_LOG"
    fi
    wait_until redis "$REDIS_LOG" redis_answers
}
redis_answers() { [ "$(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" = PONG ]; }

postgres_up() {
    local version cluster_dir hba
    version=$(pg_version)
    cluster_dir=/etc/postgresql/$version/main
    if [ ! -d "$cluster_dir" ]; then
        log "creating PostgreSQL $version's cluster main"
        pg_createcluster "$version" main >/dev/null || fail postgres "pg_createcluster failed"
    fi
    # Debian's default is peer auth on the socket and scram over TCP: the suite connects as
    # postgres or root with no password, over both.
    hba=$'local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust'
    local changed=""
    if [ "$(cat "$cluster_dir/pg_hba.conf")" != "$hba" ]; then
        printf '%s\n' "$hba" >"$cluster_dir/pg_hba.conf"
        changed=1
    fi
    # Two chaos lanes run PostgreSQL scenarios side by side beside the other workers' tests:
    # the default 100 connections is too few for them (a restart is needed to change it).
    local settings=$'# written by scripts/services.sh\nmax_connections = 300'
    local restart=""
    if [ "$(cat "$cluster_dir/conf.d/reliable-sub.conf" 2>/dev/null)" != "$settings" ]; then
        mkdir -p "$cluster_dir/conf.d"
        printf '%s\n' "$settings" >"$cluster_dir/conf.d/reliable-sub.conf"
        restart=1
    fi
    local pg_log=/var/log/postgresql/postgresql-$version-main.log
    if port_open 5432 && [ -n "$restart" ]; then
        log "PostgreSQL: max_connections = 300 written to conf.d, restarting"
        pg_ctlcluster --skip-systemctl-redirect "$version" main restart \
            || fail postgres "pg_ctlcluster could not restart the cluster" "$pg_log"
    elif ! port_open 5432; then
        log "starting PostgreSQL $version on 127.0.0.1:5432"
        pg_ctlcluster --skip-systemctl-redirect "$version" main start \
            || fail postgres "pg_ctlcluster could not start the cluster" "$pg_log"
    elif [ -n "$changed" ]; then
        log "PostgreSQL: trust auth written to pg_hba.conf, reloading"
        pg_ctlcluster --skip-systemctl-redirect "$version" main reload
    fi
    wait_until postgres "$pg_log" psql -h 127.0.0.1 -U postgres -d postgres -Atc 'select 1'
    local sql
    sql="select 1 from pg_roles where rolname = 'root'"
    [ -n "$(psql -h 127.0.0.1 -U postgres -d postgres -Atc "$sql")" ] \
        || psql -q -h 127.0.0.1 -U postgres -d postgres -c 'create role root superuser login' \
        || fail postgres "could not create the role root" "$pg_log"
    for database in test root; do
        sql="select 1 from pg_database where datname = '$database'"
        [ -n "$(psql -h 127.0.0.1 -U postgres -d postgres -Atc "$sql")" ] \
            || psql -q -h 127.0.0.1 -U postgres -d postgres -c "create database $database" \
            || fail postgres "could not create the database $database" "$pg_log"
    done
}

mariadb_up() {
    if ! port_open 3306; then
        log "starting MariaDB on 127.0.0.1:3306"
        mkdir -p /run/mysqld /var/log/mysql
        chown mysql:mysql /run/mysqld /var/log/mysql
        if [ ! -d /var/lib/mysql/mysql ]; then
            mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null \
                || fail mariadb "mariadb-install-db could not create the data directory"
        fi
        start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd -- \
            --user=mysql --bind-address=127.0.0.1 --port=3306 --log-error="$MARIADB_LOG" \
            || fail mariadb "mariadbd did not start" "$MARIADB_LOG"
    fi
    wait_until mariadb "$MARIADB_LOG" mariadb --protocol=socket -uroot -e 'select 1'
    # Debian's root@localhost authenticates by unix_socket; the suite logs in over TCP with no
    # password, as root@localhost or root@127.0.0.1.
    if ! mariadb -h 127.0.0.1 -P 3306 -uroot -e 'select 1' test >/dev/null 2>&1; then
        log "MariaDB: root without a password over TCP, database test"
        mariadb --protocol=socket -uroot <<'SQL' || fail mariadb "could not set up root and test" "$MARIADB_LOG"
ALTER USER root@localhost IDENTIFIED VIA mysql_native_password USING PASSWORD('');
CREATE USER IF NOT EXISTS root@'127.0.0.1' IDENTIFIED BY '';
GRANT ALL ON *.* TO root@'127.0.0.1' WITH GRANT OPTION;
CREATE DATABASE IF NOT EXISTS test;
FLUSH PRIVILEGES;
SQL
    fi
    mariadb -h 127.0.0.1 -P 3306 -uroot -e 'select 1' test >/dev/null 2>&1 \
        || fail mariadb "root still cannot log in over TCP without a password" "$MARIADB_LOG"
}

rabbitmq_up() {
    if ! port_open 5672; then
        log "starting RabbitMQ on 127.0.0.1:5672"
        mkdir -p "$RABBITMQ_LOG_DIR"
        chown rabbitmq:rabbitmq "$RABBITMQ_LOG_DIR" 2>/dev/null || true
        # AMQP, epmd and the node's distribution port on loopback only
        ERL_EPMD_ADDRESS=127.0.0.1 RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}" \
            rabbitmq-server -detached \
            || fail rabbitmq "rabbitmq-server -detached failed" "$(rabbitmq_log)"
    fi
    wait_until rabbitmq "$(rabbitmq_log)" rabbitmq_answers
}
rabbitmq_answers() { rabbitmq-diagnostics -q check_port_connectivity && port_open 5672; }
rabbitmq_log() { ls -t "$RABBITMQ_LOG_DIR"/*.log 2>/dev/null | head -n 1 || echo "$RABBITMQ_LOG_DIR"; }

nats_up() {
    if ! port_open 4222; then
        log "starting NATS (JetStream) on 127.0.0.1:4222"
        mkdir -p /var/lib/nats-server "$(dirname "$NATS_LOG")"
        start-stop-daemon --start --oknodo --background --make-pidfile \
            --pidfile "$NATS_PIDFILE" --exec "$(command -v nats-server)" -- \
            -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l "$NATS_LOG" \
            || fail nats "nats-server did not start" "$NATS_LOG"
    fi
    wait_until nats "$NATS_LOG" port_open 4222
}

# The Java servers the tests start themselves (Apache Kafka, ElasticMQ for SQS) run from jars that
# Maven resolves into a per-machine cache; tests/maven_jars.py is the one place that does it (the
# fixtures call it too): a no-op in a tenth of a second once the cache has them.
MAVEN_JARS="$(dirname "$0")/../tests/maven_jars.py"

java_servers_up() {
    python3 "$MAVEN_JARS" || fail maven "could not resolve the Kafka or ElasticMQ jars (see above)"
}

# --- commands ---------------------------------------------------------------------------------

up() {
    local started=$SECONDS
    install_missing
    redis_up
    postgres_up
    mariadb_up
    rabbitmq_up
    nats_up
    java_servers_up
    log "all up in $((SECONDS - started)) s"
}

status() {
    local down=0 name port
    for entry in redis:6379 postgres:5432 mariadb:3306 rabbitmq:5672 nats:4222; do
        name=${entry%%:*} port=${entry##*:}
        if port_open "$port"; then
            printf '%-9s up on 127.0.0.1:%s\n' "$name" "$port"
        else
            printf '%-9s down (nothing on 127.0.0.1:%s)\n' "$name" "$port"
            down=1
        fi
    done
    python3 "$MAVEN_JARS" --check || down=1
    local missing
    missing=$(missing_packages | tr '\n' ' ')
    if [ -n "${missing// /}" ]; then
        printf 'missing packages: %s\n' "$missing"
        down=1
    else
        printf 'installed: nats-server, prometheus, redis-cli, the Pub/Sub emulator, java, mvn\n'
    fi
    return "$down"
}

down() {
    port_open 6379 && { log "stopping Redis"; redis-cli -p 6379 shutdown nosave || true; }
    if port_open 5432; then
        log "stopping PostgreSQL"
        pg_ctlcluster --skip-systemctl-redirect "$(pg_version)" main stop || true
    fi
    if port_open 3306; then
        log "stopping MariaDB"
        start-stop-daemon --stop --oknodo --retry 30 --exec /usr/sbin/mariadbd || true
    fi
    port_open 5672 && { log "stopping RabbitMQ"; rabbitmqctl stop >/dev/null || true; }
    if port_open 4222; then
        log "stopping NATS"
        start-stop-daemon --stop --oknodo --retry 10 --pidfile "$NATS_PIDFILE" \
            --exec "$(command -v nats-server)" || true
    fi
    return 0
}

case "${1:-}" in
    up) up ;;
    status) status ;;
    down) down ;;
    *) echo "usage: $0 up|status|down" >&2; exit 2 ;;
esac
