-- A tier's counters per calling cluster (`require("tier_metrics")`, from the run directory), kept in the
-- lua_shared_dict mm_cache_stats so that every worker process adds to the same numbers:
--   record()          each encode request's log phase: requests, cache result, bytes sent, upstream errors
--                     (and the router's shard), labelled by $mm_cluster (resolved in the config's maps),
--                     and a cache tier's flat counters by result
--   prometheus(tier)  GET /metrics: Prometheus text exposition
--   stats()           GET /_cache/stats: the flat counters of old ("HIT", "requests", ...) and "clusters"
-- The families (names, help, labels) are tier_metrics_families.lua, written from
-- mm_encoder/cache_tiers/metrics.py. Keys: "m|<family>|<label value>|..." for a counter, "l|<kind>|<value>"
-- for a label value admitted (see `bounded`); label values never hold "|" (checked names, statuses,
-- cache results, addresses).

local families = require("tier_metrics_families")
local M = {}

-- `value`, or "other" once max_labels distinct values of `kind` have been admitted: the dict has a fixed
-- size and evicts counters when full, so a caller that sends new names must not add keys without end.
local function bounded(kind, value)
    local d = ngx.shared.mm_cache_stats
    local key = "l|" .. kind .. "|" .. value
    if d:get(key) then
        return value
    end
    local seen = "l#" .. kind
    local n = d:incr(seen, 1, 0)
    if n and n <= families.max_labels then
        local ok, err = d:safe_add(key, 1)
        if ok then
            return value
        end
        d:incr(seen, -1)
        if err == "exists" then  -- another worker admitted it first
            return value
        end
        return "other"
    end
    d:incr(seen, -1)
    return "other"
end

local function count(n, ...)
    local key = "m|" .. table.concat({...}, "|")
    local ok, err = ngx.shared.mm_cache_stats:incr(key, n, 0)
    if not ok then
        ngx.log(ngx.WARN, "tier metrics: cannot count ", key, ": ", err)
    end
end

function M.record()
    local v = ngx.var
    local router = v.mm_tier == "router"
    if not router then  -- the flat counters of /_cache/stats (`mm-encoder status`): every answer, by result
        local d = ngx.shared.mm_cache_stats
        d:incr(v.upstream_cache_status or "NONE", 1, 0)
        d:incr("requests", 1, 0)
    end
    local cluster = bounded("cluster", v.mm_cluster or "unknown")
    count(1, "requests", cluster)
    count(tonumber(v.bytes_sent) or 0, "bytes", cluster)
    local result = v.upstream_cache_status
    if not router and result and result ~= "" then
        count(1, "results", cluster, result)
    end
    local upstream = v.upstream_addr
    if upstream == nil or upstream == "" then  -- answered here: a hit, or refused before any next level
        return
    end
    local status = ngx.status
    if status >= 500 then  -- an upstream may answer any number: at most 101 values
        count(1, "errors", cluster, status <= 599 and tostring(status) or "other")
    end
    if router then  -- "a:1, b:2" when the first shard could not be reached: the last one answered
        count(1, "shard", bounded("shard", upstream:match("([^,%s]+)%s*$") or upstream))
    end
end

local function escape(s)
    return (s:gsub("\\", "\\\\"):gsub('"', '\\"'):gsub("\n", "\\n"))
end

-- {family key -> {{label values joined by "|", count}, ...}}
local function counters()
    local d = ngx.shared.mm_cache_stats
    local out = {}
    for _, k in ipairs(d:get_keys(0)) do
        local family, values = k:match("^m|([^|]+)|(.*)$")
        if family then
            out[family] = out[family] or {}
            table.insert(out[family], {values, d:get(k) or 0})
        end
    end
    return out
end

-- One family's HELP, TYPE and samples, appended to `out`; `rows` as `counters` gives them.
local function family_lines(out, f, tier, rows)
    out[#out + 1] = "# HELP " .. f.name .. " " .. f.help
    out[#out + 1] = "# TYPE " .. f.name .. " " .. f.type
    table.sort(rows, function(a, b) return a[1] < b[1] end)
    for _, row in ipairs(rows) do
        local labels, i = {'tier="' .. tier .. '"'}, 0
        for value in (row[1] .. "|"):gmatch("([^|]*)|") do
            i = i + 1
            labels[#labels + 1] = (f.labels[i] or "extra") .. '="' .. escape(value) .. '"'
        end
        out[#out + 1] = string.format("%s{%s} %.0f", f.name, table.concat(labels, ","), row[2])
    end
end

function M.prometheus(tier)
    local found = counters()
    local out = {}
    for _, f in ipairs(families) do
        if f.tiers[tier] then
            family_lines(out, f, tier, found[f.key] or {})
        end
    end
    ngx.print(table.concat(out, "\n"), "\n")
end

-- One calling cluster's counters as a JSON object's members: requests, bytes, errors (every status),
-- and one member per cache result (HIT, MISS, ...).
local function cluster_json(c)
    local parts = {}
    for _, k in ipairs({"requests", "bytes", "errors"}) do
        parts[#parts + 1] = string.format('"%s": %.0f', k, c[k] or 0)
    end
    local results = {}
    for k in pairs(c.results) do results[#results + 1] = k end
    table.sort(results)
    for _, k in ipairs(results) do
        parts[#parts + 1] = string.format('"%s": %.0f', k, c.results[k])
    end
    return "{" .. table.concat(parts, ", ") .. "}"
end

function M.stats()
    local d = ngx.shared.mm_cache_stats
    local parts = {}
    for _, k in ipairs(d:get_keys(0)) do  -- the counters of old: one per cache result, and "requests"
        if not k:find("[|#]") then
            parts[#parts + 1] = string.format('"%s": %.0f', k, d:get(k) or 0)
        end
    end
    local clusters, names = {}, {}
    for family, rows in pairs(counters()) do
        for _, row in ipairs(rows) do
            local name, extra = row[1]:match("^([^|]*)|?(.*)$")
            if family ~= "shard" then
                local c = clusters[name]
                if not c then
                    c = {results = {}}
                    clusters[name] = c
                    names[#names + 1] = name
                end
                if family == "results" then
                    c.results[extra] = row[2]
                else
                    c[family] = (c[family] or 0) + row[2]
                end
            end
        end
    end
    if #names > 0 then
        table.sort(names)
        local members = {}
        for _, name in ipairs(names) do
            members[#members + 1] = string.format('"%s": %s', name, cluster_json(clusters[name]))
        end
        parts[#parts + 1] = '"clusters": {' .. table.concat(members, ", ") .. "}"
    end
    ngx.say("{" .. table.concat(parts, ", ") .. "}")
end

return M
