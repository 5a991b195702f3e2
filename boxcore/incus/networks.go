package incus

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"path"
)

// Network is an Incus network (managed or not).
type Network struct {
	Name        string            `json:"name"`
	Type        string            `json:"type"` // "bridge", "physical", "loopback", ...
	Description string            `json:"description"`
	Managed     bool              `json:"managed"`
	Config      map[string]string `json:"config"`
	UsedBy      []string          `json:"used_by"`
	Status      string            `json:"status"`
	Locations   []string          `json:"locations,omitempty"`
}

// NetworkLease is a DHCP lease (or static allocation) of a managed network.
type NetworkLease struct {
	Hostname string `json:"hostname"`
	Hwaddr   string `json:"hwaddr"`
	Address  string `json:"address"`
	Type     string `json:"type"` // "static" | "dynamic" | "gateway"
	Location string `json:"location"`
}

// Network returns one network and its ETag.
func (c *Client) Network(ctx context.Context, name string) (Network, string, error) {
	var n Network
	etag, err := c.get(ctx, "/1.0/networks/"+esc(name), &n)
	return n, etag, err
}

// NetworkOn is the network as cluster member sees it (GET ?target=member): the cluster-wide
// config merged with that member's own keys (bridge.external_interfaces, ...), which a GET
// without a target leaves out. member "" is Network.
func (c *Client) NetworkOn(ctx context.Context, name, member string) (Network, string, error) {
	var n Network
	etag, err := c.get(ctx, memberPath("/1.0/networks/"+esc(name), member), &n)
	return n, etag, err
}

// UpdateNetworkOn writes the network's config as member sees it (PUT ?target=member). config
// must be the whole config NetworkOn read, changed: Incus 6.0.4 takes it as the network's
// config on that member, cluster-wide keys included (an empty one emptied the cluster-wide
// config too, measured on the test cluster).
func (c *Client) UpdateNetworkOn(ctx context.Context, name, member string, config map[string]string, description, etag string) error {
	if config == nil {
		config = map[string]string{}
	}
	_, err := c.call(ctx, http.MethodPut, memberPath("/1.0/networks/"+esc(name), member),
		map[string]any{"config": config, "description": description}, &reqOpts{etag: etag})
	return err
}

// BridgeState is what a member's kernel shows of a managed network's interface, as its daemon
// reads it: NetworkState plus the bridge's ports.
type BridgeState struct {
	NetworkState
	Bridge *struct {
		UpperDevices []string `json:"upper_devices"` // the bridge's ports
	} `json:"bridge"`
}

// NetworkStateOn reads the network's interface on member ("" : this daemon's own), from that
// member's kernel through its daemon.
func (c *Client) NetworkStateOn(ctx context.Context, name, member string) (BridgeState, error) {
	var st BridgeState
	_, err := c.get(ctx, memberPath("/1.0/networks/"+esc(name)+"/state", member), &st)
	return st, err
}

// memberPath adds ?target=member to path when member is set.
func memberPath(path, member string) string {
	if member == "" {
		return path
	}
	return path + "?target=" + url.QueryEscape(member)
}

// Networks lists all networks, managed or not.
func (c *Client) Networks(ctx context.Context) ([]Network, error) {
	var out []Network
	if _, err := c.get(ctx, "/1.0/networks?recursion=1", &out); err != nil {
		return nil, err
	}
	return out, nil
}

// NetworkNames lists the names of all networks, managed or not, without their details (the
// details cost the daemon a used-by scan per network, host interfaces included).
func (c *Client) NetworkNames(ctx context.Context) ([]string, error) {
	var urls []string
	if _, err := c.get(ctx, "/1.0/networks", &urls); err != nil {
		return nil, err
	}
	names := make([]string, 0, len(urls))
	for _, u := range urls {
		name, err := url.PathUnescape(path.Base(u))
		if err != nil {
			return nil, fmt.Errorf("incus: network URL %q: %w", u, err)
		}
		names = append(names, name)
	}
	return names, nil
}

// CreateNetworkPending defines a network on one cluster member only (POST ?target=MEMBER),
// with that member's own keys: on a cluster a network is created once per member this way,
// then once more without a target with the cluster-wide config (CreateNetwork).
func (c *Client) CreateNetworkPending(ctx context.Context, member, name, typ string, memberConfig map[string]string) error {
	return c.createOnMember(ctx, "/1.0/networks", member, map[string]any{"name": name, "type": typ}, memberConfig)
}

// CreateNetwork creates a managed network of type typ ("bridge" usually). Incus 6.0.4's
// "Failed to delete bridge children interfaces" while it brings the bridge up is retried
// (IsBridgeChildrenRace; Incus reverts the failed create). Should a retry find the network
// there all the same, with the config asked for, the create counts as done.
func (c *Client) CreateNetwork(ctx context.Context, name, typ string, config map[string]string, description string) error {
	if config == nil {
		config = map[string]string{}
	}
	raced := false
	return RetryBridgeChildrenRace(ctx, func() error {
		_, err := c.call(ctx, http.MethodPost, "/1.0/networks", map[string]any{
			"name": name, "type": typ, "config": config, "description": description}, nil)
		if raced && errors.Is(err, ErrConflict) {
			if n, _, gerr := c.Network(ctx, name); gerr == nil && n.Type == typ && hasConfig(n.Config, config) {
				return nil
			}
		}
		raced = raced || IsBridgeChildrenRace(err)
		return err
	})
}

// hasConfig: every key of want has its value in have.
func hasConfig(have, want map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}

// UpdateNetwork replaces a network's config and description (PUT). etag, when not empty,
// makes the update conditional.
func (c *Client) UpdateNetwork(ctx context.Context, name string, config map[string]string, description string, etag string) error {
	if config == nil {
		config = map[string]string{}
	}
	_, err := c.call(ctx, http.MethodPut, "/1.0/networks/"+esc(name),
		map[string]any{"config": config, "description": description}, &reqOpts{etag: etag})
	return err
}

// DeleteNetwork deletes a managed network. Incus 6.0.4's "Failed to delete bridge children
// interfaces" while it takes the bridge down is retried (IsBridgeChildrenRace); a retry that
// finds the network gone counts as done.
func (c *Client) DeleteNetwork(ctx context.Context, name string) error {
	raced := false
	return RetryBridgeChildrenRace(ctx, func() error {
		_, err := c.call(ctx, http.MethodDelete, "/1.0/networks/"+esc(name), nil, nil)
		if raced && errors.Is(err, ErrNotFound) {
			return nil
		}
		raced = raced || IsBridgeChildrenRace(err)
		return err
	})
}

// NetworkLeases lists a managed network's DHCP leases.
func (c *Client) NetworkLeases(ctx context.Context, name string) ([]NetworkLease, error) {
	var out []NetworkLease
	if _, err := c.get(ctx, "/1.0/networks/"+esc(name)+"/leases", &out); err != nil {
		return nil, err
	}
	return out, nil
}

// ACLRule is one rule of a network ACL.
type ACLRule struct {
	Action          string `json:"action"` // "allow" | "reject" | "drop" | "allow-stateless"
	Source          string `json:"source,omitempty"`
	Destination     string `json:"destination,omitempty"`
	Protocol        string `json:"protocol,omitempty"` // "tcp" | "udp" | "icmp4" | "icmp6"
	SourcePort      string `json:"source_port,omitempty"`
	DestinationPort string `json:"destination_port,omitempty"`
	ICMPType        string `json:"icmp_type,omitempty"`
	ICMPCode        string `json:"icmp_code,omitempty"`
	Description     string `json:"description,omitempty"`
	State           string `json:"state"` // "enabled" | "disabled" | "logged"
}

// NetworkACL is a network ACL.
type NetworkACL struct {
	Name        string            `json:"name"`
	Description string            `json:"description"`
	Egress      []ACLRule         `json:"egress"`
	Ingress     []ACLRule         `json:"ingress"`
	Config      map[string]string `json:"config"`
	UsedBy      []string          `json:"used_by,omitempty"`
}

type aclPut struct {
	Description string            `json:"description"`
	Egress      []ACLRule         `json:"egress"`
	Ingress     []ACLRule         `json:"ingress"`
	Config      map[string]string `json:"config"`
}

func (a NetworkACL) put() aclPut {
	p := aclPut{Description: a.Description, Egress: a.Egress, Ingress: a.Ingress, Config: a.Config}
	if p.Egress == nil {
		p.Egress = []ACLRule{}
	}
	if p.Ingress == nil {
		p.Ingress = []ACLRule{}
	}
	if p.Config == nil {
		p.Config = map[string]string{}
	}
	for _, rs := range [][]ACLRule{p.Egress, p.Ingress} {
		for i := range rs {
			if rs[i].State == "" {
				rs[i].State = "enabled"
			}
		}
	}
	return p
}

// NetworkACL returns one ACL and its ETag.
func (c *Client) NetworkACL(ctx context.Context, name string) (NetworkACL, string, error) {
	var a NetworkACL
	etag, err := c.get(ctx, "/1.0/network-acls/"+esc(name), &a)
	return a, etag, err
}

// CreateNetworkACL creates an ACL. Rules with an empty State are created "enabled".
func (c *Client) CreateNetworkACL(ctx context.Context, acl NetworkACL) error {
	body := struct {
		Name string `json:"name"`
		aclPut
	}{acl.Name, acl.put()}
	_, err := c.call(ctx, http.MethodPost, "/1.0/network-acls", body, nil)
	return err
}

// UpdateNetworkACL replaces an ACL's rules, config and description (PUT).
func (c *Client) UpdateNetworkACL(ctx context.Context, acl NetworkACL, etag string) error {
	_, err := c.call(ctx, http.MethodPut, "/1.0/network-acls/"+esc(acl.Name), acl.put(), &reqOpts{etag: etag})
	return err
}

// DeleteNetworkACL deletes an ACL (it must be unused).
func (c *Client) DeleteNetworkACL(ctx context.Context, name string) error {
	_, err := c.call(ctx, http.MethodDelete, "/1.0/network-acls/"+esc(name), nil, nil)
	return err
}

// NetworkACLs lists all network ACLs.
func (c *Client) NetworkACLs(ctx context.Context) ([]NetworkACL, error) {
	var out []NetworkACL
	if _, err := c.get(ctx, "/1.0/network-acls?recursion=1", &out); err != nil {
		return nil, err
	}
	return out, nil
}
